"""`python -m benchmarks.gpu_acceptance` (what scripts/gpu_check.sh runs), or by path,
`python benchmarks/gpu_acceptance --worker NAME ARG...`, as the checks start their workers."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if Path(sys.path[0]).resolve() == HERE:  # run by path: import from the repository, not from this folder
    sys.path[0] = str(HERE.parents[1])

from benchmarks.gpu_acceptance.cli import main  # noqa: E402

sys.exit(main())
