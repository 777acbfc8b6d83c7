"""The OpenAI-compatible gateway (needs the ``serve`` extra; the embedded backend, ``train``)."""
