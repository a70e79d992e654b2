"""seqcache.pipelines"""
