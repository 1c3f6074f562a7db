"""qvpic's online path: the Ray Serve application (`import_path: serve.app:build_app`).

    app.py       the builder: one typed config per deployment, bound by keyword
    config.py    `AppConfig` and the per-role configs it nests (the ingress's governance too)
    plan.py      the typed data that travels between the deployments
    metrics.py   Prometheus metrics of the serving path
    handles.py   awaiting another deployment's response, cancelled with its caller
    http/        ingress → governance/ → routing/ → kv/ → engine/ (the generator)

`build_app` and `AppConfig` are this package's public API.
"""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "app": ["build_app"],
    "config": ["AppConfig"],
})
