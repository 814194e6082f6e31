"""Test and benchmark support shipped with the package: the global-head oracle and the cluster harness."""
