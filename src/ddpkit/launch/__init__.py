"""Starting the processes of a job: torchrun's elastic agent (``launcher``), its rendezvous on chosen
addresses (``rendezvous``), each rank's output kept in a file (``rank_logs``), NCCL settings (``nccl``)
and the processes an earlier run left behind (``processes``). Imports only the core."""
