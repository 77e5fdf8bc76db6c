"""Running on a SLURM allocation (docs/slurm.md).

``unicron-run --slurm`` names the run after ``SLURM_JOB_ID`` and the node
after ``SLURMD_NODENAME``, leaves at a step boundary when SLURM drains the
node and stops on SLURM's warning signal; ``unicron slurm etcd`` runs the
store inside the allocation; :class:`~unicron_elastic.slurm.preemption.PreemptionCheckpoint`
writes the step a stop ends at and requeues the job.
"""

from unicron_elastic.slurm.api import (
    FINISHED_EXIT_CODE,
    EtcdMember,
    NotUnderSlurm,
    SlurmCommandError,
    SlurmJob,
)

__all__ = ["FINISHED_EXIT_CODE", "EtcdMember", "NotUnderSlurm", "SlurmCommandError", "SlurmJob"]
