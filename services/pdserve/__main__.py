import sys

from pdserve.cli.main import main
from pdserve.common.runtime import install_fast_event_loop

# uvloop when installed; PDSERVE_UVLOOP=0 keeps the standard loop (read here, before any loop).
install_fast_event_loop()
sys.exit(main())
