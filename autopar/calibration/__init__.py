"""The measurements behind ``autopar calibrate`` (autopar/calibrate.py, which runs them and
says what each gives the profile): timing.py how a call is timed, kernels.py the kernels'
curves and costs, host.py the host's time, link.py the collectives, fit.py the link's
model fitted to them, profile.py the profile written."""
