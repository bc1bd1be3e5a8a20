import sys

from kvtier.daemon.main import main

sys.exit(main())
