"""The core every other part stands on: who this process is (``env``), its process group
(``process_group``), errors, logging, signals and preemption, the network (``network``), each rank's
progress marks (``progress``) and CPU snapshots of state. Imports nothing else of ddpkit."""
