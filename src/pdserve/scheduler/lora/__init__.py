"""pdserve.scheduler.lora"""
