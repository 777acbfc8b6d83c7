"""The gateway's routes, one ``APIRouter`` a concern, each serving with the app's
``GatewayState``; ``create_app`` includes them all."""
