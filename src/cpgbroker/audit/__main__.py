"""``python -m cpgbroker.audit`` (also runnable as a script by ``spark-submit``)."""

import sys

from cpgbroker.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
