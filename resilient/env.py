"""Names of the environment variables ``resilient-run`` exports to its workers (a public contract)."""

RUN_DIR = "RESILIENT_RUN_DIR"  # the run's directory: ledger, logs
RUN_ID = "RESILIENT_RUN_ID"
NODE = "RESILIENT_NODE"  # this node's name in events
NODE_RANK = "RESILIENT_NODE_RANK"
AGENT_SOCKET = "RESILIENT_AGENT_SOCKET"  # the node agent's local socket for heartbeats/steps
CKPT_LOCAL = "RESILIENT_CKPT_LOCAL"  # this node's local checkpoint directory
CKPT_PERSISTENT = "RESILIENT_CKPT_PERSISTENT"  # fsspec URL of the persistent tier
CKPT_INTERVAL = "RESILIENT_CKPT_INTERVAL"  # "N" steps or "auto"
CKPT_PERSISTENT_EVERY = "RESILIENT_CKPT_PERSISTENT_EVERY"  # every M-th local save is uploaded
CKPT_COMPRESS = "RESILIENT_CKPT_COMPRESS"  # auto | none | bgzstd | zstd: compression of persistent uploads
UPLOAD_GRACE = "RESILIENT_UPLOAD_GRACE"  # seconds pending uploads get at exit before they are abandoned
# consecutive saves that reach no tier before the job stops (0: train on without checkpoints); also the default
# of resilient-run --ckpt-max-failed-saves
CKPT_MAX_FAILED_SAVES = "RESILIENT_CKPT_MAX_FAILED_SAVES"
HEARTBEAT_TIMEOUT = "RESILIENT_HEARTBEAT_TIMEOUT"  # seconds
POLICY = "RESILIENT_POLICY"
SPARE_NODES = "RESILIENT_SPARE_NODES"
JOB_SECRET = "RESILIENT_JOB_SECRET"  # per-job secret signing agent <-> supervisor messages (never logged)

# read by resilient itself (set by users or recipes, not by the launcher)
LOG_LEVEL = "RESILIENT_LOG_LEVEL"  # log level of agents, supervisor and workers' resilient loggers
WORKER_LAUNCH = "RESILIENT_WORKER_LAUNCH"  # default of --worker-launch
PRELOAD = "RESILIENT_PRELOAD"  # default of --preload
PREEMPT_URL = "RESILIENT_PREEMPT_URL"  # an HTTP preemption-notice endpoint the agent polls
COMPILE_CACHE = "RESILIENT_COMPILE_CACHE"  # "0" turns the torch.compile cache off
FAULTS = "RESILIENT_FAULTS"  # a drill's in-worker faults (--inject), carried out by resilient.steps()
RDZV_ID = "PET_RDZV_ID"  # torchrun's variable for --rdzv-id; also the default of `resilient supervisor --rdzv-id`
