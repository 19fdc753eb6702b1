"""What protrain shows: graph dumps per stage with the plan's annotations, and the memory
timeline plot."""
