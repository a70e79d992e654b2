"""seqcache.pipelines: the deterministic Beam pipeline that builds token caches.

    from seqcache.pipelines import build_task, BuildConfig
    result = build_task(task, cache_dir="caches", config=BuildConfig(seed=0))
"""

from seqcache.pipelines.build import BuildConfig, BuildError, BuildResult, build_task, cache_path

__all__ = ["BuildConfig", "BuildError", "BuildResult", "build_task", "cache_path"]
