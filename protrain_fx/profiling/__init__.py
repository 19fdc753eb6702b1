"""Measuring a graph: static analysis of the partitioned graphs (saved bytes per block), the one
profiled step under the profiling plan, and the step meter that measures the chosen plan's time and
peak.
"""
