"""The interactive API docs (`/docs`, Swagger UI; `/redoc`, ReDoc) served with their scripts and
styles from the `fastapi-offline` package, so that they render on a machine without internet.
FastAPI's own pages load those assets (and a favicon and fonts) from CDNs, and render blank there."""
from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

# swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js and favicon.png, as the package ships them.
ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSETS_ROUTE = "/docs-assets"


def install_offline_docs(app: FastAPI) -> None:
    """Replace FastAPI's CDN-backed pages at `app.docs_url` and `app.redoc_url` (`/docs` and
    `/redoc` when those are None) by the same pages with packaged assets. The Swagger UI OAuth2
    redirect page that FastAPI adds is kept: it loads nothing from outside."""
    docs_url, redoc_url = app.docs_url or "/docs", app.redoc_url or "/redoc"
    app.router.routes[:] = [route for route in app.router.routes
                            if getattr(route, "path", None) not in (docs_url, redoc_url)]
    app.mount(ASSETS_ROUTE, StaticFiles(directory=ASSETS_DIR), name="docs-assets")
    app.add_route(docs_url, _swagger_ui, include_in_schema=False)
    app.add_route(redoc_url, _redoc, include_in_schema=False)


async def _swagger_ui(request: Request) -> HTMLResponse:
    app, root = request.app, _root_path(request)
    redirect_url = app.swagger_ui_oauth2_redirect_url
    return get_swagger_ui_html(
        openapi_url=root + app.openapi_url, title=f"{app.title} - Swagger UI",
        oauth2_redirect_url=redirect_url and root + redirect_url,
        init_oauth=app.swagger_ui_init_oauth, swagger_ui_parameters=app.swagger_ui_parameters,
        swagger_js_url=f"{root}{ASSETS_ROUTE}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS_ROUTE}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS_ROUTE}/favicon.png")


async def _redoc(request: Request) -> HTMLResponse:
    app, root = request.app, _root_path(request)
    return get_redoc_html(
        openapi_url=root + app.openapi_url, title=f"{app.title} - ReDoc",
        redoc_js_url=f"{root}{ASSETS_ROUTE}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{ASSETS_ROUTE}/favicon.png", with_google_fonts=False)


def _root_path(request: Request) -> str:
    """The prefix a proxy mounts the app under (uvicorn's --root-path), as FastAPI's own pages use it."""
    return request.scope.get("root_path", "").rstrip("/")
