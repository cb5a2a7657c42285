"""kvgate ext_proc: the Endpoint Picker Protocol service and its routing core."""
