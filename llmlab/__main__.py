import sys

from llmlab.entrypoints.cli import main

sys.exit(main())
