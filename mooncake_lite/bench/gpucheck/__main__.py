import sys

from mooncake_lite.bench.gpucheck.cli import main

sys.exit(main(sys.argv[1:]))
