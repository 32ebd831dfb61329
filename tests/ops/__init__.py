"""Tests of each op (one folder per op, as ficco/ops/) and of what the ops share."""
