import sys

from onebitlamb.cli import main

sys.exit(main())
