"""Tuning: the cost model, machine profiles (data files with sources), algorithm selection
(auto) and calibration of a profile on the machine at hand. The cost model, profiles and
selection import without MPI or the native module; calibration measures over MPI."""
