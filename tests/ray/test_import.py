"""``import procgroup.ray`` stays free of ray and torch (they load only inside the functions that need them)."""

import subprocess
import sys


def test_import_procgroup_ray_imports_neither_ray_nor_torch():
    code = (
        "import sys, procgroup, procgroup.ray as r; r.JobSpec; r.__dir__(); "
        "assert 'ray' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_core_never_imports_procgroup_ray():
    code = "import sys, procgroup as d; d.init_process_group; d.all_reduce; assert 'procgroup.ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
