import sys
from pathlib import Path

# Make the shared cases module importable whatever pytest's rootdir and import mode are.
sys.path.insert(0, str(Path(__file__).parent))
