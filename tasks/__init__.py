"""seqcache.tasks"""
