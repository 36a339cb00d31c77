"""The engine: request queue, scheduler, pools, model runner and sampler behind `Engine`."""
