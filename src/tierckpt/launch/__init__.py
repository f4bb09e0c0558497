"""Launching a training command under a scheduler so that every interruption ends the
right way: the Slurm batch script (:mod:`.slurm`), the Kubernetes manifests (:mod:`.k8s`),
the notice lead they ask for (:mod:`.timing`), the verdict after the job step ends
(:mod:`.outcome`) and the checks of ``tierckpt doctor --cluster`` (:mod:`.cluster`).
Torch-free: the CLI imports all of it.

Import from the submodules; this package re-exports nothing.
"""
