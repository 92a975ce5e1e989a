import sys

from hybrid_engine.cli import main

sys.exit(main())
