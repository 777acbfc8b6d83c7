"""Training of capability experts, routers and gates (needs the ``train`` extra)."""
