import sys

from cpgbroker.cli import main

sys.exit(main())
