"""The dashboard's routes, one APIRouter a page, over ``DashboardState``."""
