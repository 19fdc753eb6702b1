"""What the machine is and can do, measured or read live: device and host memory, pinned host
memory, the caching allocator's settings, the CPU Adam kernel, copy bandwidths and optimizer rates
(the hardware profile). Imports nothing of protrain but the base modules (errors, options, config).
"""
