"""pdserve.scheduler.round"""
