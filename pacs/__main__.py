import sys

from pacs.cli import main

sys.exit(main())
