# Linear algebra with numpy (LAPACK through OpenBLAS): solve, determinant, eigenvalues,
# least squares.
import numpy as np

A = np.array([[4.0, -2.0, 1.0], [-2.0, 4.0, -2.0], [1.0, -2.0, 4.0]])
b = np.array([11.0, -16.0, 17.0])
x = np.linalg.solve(A, b)
print("x =", np.round(x, 6))
print("det =", round(float(np.linalg.det(A)), 6))
print("eigenvalues =", np.round(np.linalg.eigvalsh(A), 4))
X = np.column_stack([np.ones(5), np.arange(5.0)])
y = np.array([1.0, 3.0, 5.0, 7.0, 9.0])
coef, *_ = np.linalg.lstsq(X, y, rcond=None)
print("intercept, slope =", np.round(coef, 6))
M = np.random.default_rng(0).standard_normal((300, 300))
print("inverse ok:", np.allclose(M @ np.linalg.inv(M), np.eye(300)))
