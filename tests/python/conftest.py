import os
import sys

# The binding needs no build step: import it from the source tree.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "abi", "python"))
