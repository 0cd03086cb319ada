"""pdserve.scheduler.cache"""
