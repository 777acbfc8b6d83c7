"""The gateway's routes, one ``APIRouter`` a concern, each serving with the app's
:class:`~trace_plugin.gateway.state.GatewayState`; ``create_app`` includes them all."""
