import sys

from kvtier.daemon.entry import main

sys.exit(main())
