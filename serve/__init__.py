"""qvpic's online path: the Ray Serve application (`import_path: serve.app:build_app`), or the same roles in one
process (`build_local`).

    app.py       `build_app`: one typed config per deployment, bound by keyword
    local.py     `build_local`: the same roles from the same config as plain objects (eval, benchmarks, tests)
    config.py    `AppConfig` and the per-role configs it nests (the ingress's governance too)
    plan.py      the typed data that travels between the deployments
    metrics.py   Prometheus metrics of the serving path
    handles.py   awaiting another deployment's response, cancelled with its caller
    http/        ingress → governance/ → routing/ → kv/ → engine/ (the generator and its engine)
    dispatch/    which generator replica a request goes to (chunk affinity)
    ui/          the inspector behind the ingress's /ui pages

`build_app`, `build_local` and `AppConfig` are this package's public API.
"""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "app": ["build_app"],
    "config": ["AppConfig"],
    "local": ["LocalStack", "build_local"],
})
