"""The records the store persists, at the bottom of the package: every layer above speaks
these types, and this package imports nothing else of trace-plugin but its errors."""
