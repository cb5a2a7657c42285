"""Node power telemetry: NVML, DCGM, Redfish and IPMI sources read on their own intervals (README.md)."""
