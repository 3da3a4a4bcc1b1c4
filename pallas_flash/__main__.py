"""``python -m pallas_flash``: the same command line as the ``pallas-flash`` script."""

from pallas_flash.tutorial.cli import main

raise SystemExit(main())
