import sys

from llmlab.server.cli import main

sys.exit(main())
