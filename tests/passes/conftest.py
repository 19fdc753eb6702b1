import os
import sys

# the synthetic pass tests share tests/passes/pass_graphs.py, imported by name (as tests/ imports
# examples/models.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
