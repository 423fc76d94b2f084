import sys

from mooncake_lite.cli import main

sys.exit(main())
