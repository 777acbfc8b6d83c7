"""A function-calling agent over stateless tools, and its own task suite (a trace-plugin target)."""

SYSTEM_PROMPT = (
    "You answer questions with the functions this request offers. When one computes what the "
    "user asks, call it with the values the user gave, then reply with its result in one sentence. "
    "When none fits, just reply."
)
