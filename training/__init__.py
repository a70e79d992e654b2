"""seqcache.training"""
