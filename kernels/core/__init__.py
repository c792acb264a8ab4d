"""What every kernel family shares: device facts (device.py), the stdlib-only GPU/Triton rules
(gpu_rules.py), the registry of implementations and their constraints (registry.py), settings
read from the environment (env_settings.py) and install.py's file (install_config.py), caches
(json_cache.py, cache_registry.py, tuning.py), launching (direct_launch.py, selfcheck.py), call
counters (stats.py), shared jit helpers (kernel_common.py) and the extension API for other packs
(extensions.py)."""
