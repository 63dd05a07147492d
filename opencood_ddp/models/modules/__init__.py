"""Building blocks of the PointPillar family, with upstream OpenCOOD's parameter names and shapes."""
