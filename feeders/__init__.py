"""seqcache.feeders"""
