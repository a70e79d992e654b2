"""seqcache.pipelines: the deterministic Beam pipeline that builds token caches.

    from seqcache.pipelines import build_task, BuildConfig
    result = build_task(task, cache_dir="caches", config=BuildConfig(seed=0))
"""

__all__ = ["BuildConfig", "BuildError", "BuildResult", "build_task", "cache_path"]


def __getattr__(name: str):
    """The names of ``__all__``, from ``pipelines/build.py`` on first use (PEP 562)."""
    if name in __all__:
        from seqcache.pipelines import build  # keeps Beam out of importing the writer (trainers' test caches)

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
