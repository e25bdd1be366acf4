"""The web console: server-rendered pages under /ui over the same core calls as the JSON API.

``api.main`` mounts it with ``app.include_router(ui.router)``. Templates and static files are
package data (no CDN, no build step); see routes.py for the pages and session.py for sign-in.
"""

from api.ui.routes import router

__all__ = ["router"]
