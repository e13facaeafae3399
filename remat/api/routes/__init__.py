"""One router per resource: graphs, solve, jobs, frontier, solvers, health."""
